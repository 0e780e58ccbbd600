"""GGUF models on llama.cpp's kernels: libllama through llama-cpp-python's low-level API, behind models/base.py.

  binding.py  libllama itself: loaded once, its log routed to `logging` (and kept for error messages)
  model.py    LlamaCppLM, the CausalLM over a GGUF file (forwards, the batch-variance check), and its loader
  caches.py   the KV caches: one context (LlamaCppCache), a context per row (LlamaCppRows), a row's view


The weights stay as the file stores them (every type llama.cpp computes on, K-quants and IQ included); leaplm's
engine drives the forwards. One `LlamaCppCache` is one llama.cpp context:

  rows      where llama.cpp is batch-invariant for the file (LlamaCppLM.batch_invariant), each row of a batch
            has a context of its own (LlamaCppRows): a row's KV cells then depend on its own tokens alone. In one
            shared context, rows that finish or roll back free cells that other rows refill, so a row's cells stop
            being in position order, and llama.cpp's attention (flash attention visits cells in cell order; the
            non-flash kernels reduce in SIMD lanes by cell index) rounds differently than for the same request
            alone: greedy near-ties flip under concurrency. A forward over [B, T] tokens is then B `llama_decode`s.
            Where llama.cpp is not batch-invariant anyway (F32, F16, repacked K-quants), rows are sequences
            b of one context (n_seq_max = rows + TREE_SEQS, a unified KV cache: `llama_memory_seq_cp` needs
            one) and a forward is one `llama_decode` of B * T batch entries (split into N_BATCH-entry calls only
            for a long prefill), which batches the weight reads.
  rollback  the same rule as cache/kv_cache.py: a forward writes a row's T tokens at positions [length, length + T)
            without moving `lengths[b]`; commit moves it. What a forward wrote past the committed length is removed
            (`llama_memory_seq_rm`) before the row's next forward, so a rejected draft costs nothing until then.
            `lengths` may also be set directly (the draft proposer and the calibration do): the next forward keeps
            only [0, lengths[b]) of that row.
  trees     llama.cpp takes no attention mask, but a token may belong to several sequences, and a token attends to
            the cells of its first sequence at positions up to its own. So a tree block is scored in one decode as
            its branches: each leaf gets a scratch sequence holding the row's committed prefix (`seq_cp`, which
            shares cells, copies nothing), and each block token belongs to the scratch sequences of the leaves
            below it (the root also to the row's own). A node then sees exactly its ancestors and itself. Commit
            copies the kept path back into the row's sequence (`compact`) and empties the scratch sequences.
            Any block whose mask is a tree with positions at depth (cache/tree.py: trees, lookahead's window)
            fits; anything else is refused.
  logits    llama.cpp computes logits only at the batch entries marked as outputs: the last token of each row
            under `last_only` (a prefill), every token of a verify block otherwise. Reading them back is one
            copy of V floats (4 V bytes) per output position, ~0.2 MB per position for a 49152-token vocabulary.
  hidden    the last hidden state after the final norm (what EAGLE and Medusa heads read) is the context's
            embeddings output, switched on only for forwards that ask for it (`forward_hidden`): llama.cpp then
            outputs every position of the batch.

Sizes are checked before `llama_decode` is called (llama.cpp asserts on some, which would abort the process): token
ids inside the vocabulary, a row's length + T within the cache's max_len, a tree within one decode. A decode that
still fails raises RuntimeError with llama.cpp's own log lines: an error for the request, never a process abort.
"""
