"""`leaplm tune`: should this model speculate, with which method or draft, at which K, at which concurrency?

candidates.py  what can run on the target (drafts that share its tokenizer, draft-free methods) and the K grid
workloads.py   tune's prompt sets: the bench workloads plus chat, noise and a user's file
memory.py      the memory each option adds (draft weights + its KV cache)
measure.py     interleaved measurement within a time budget: Engine.generate at concurrency 1, the server's
               batch scheduler in-process above
recommend.py   the decision per concurrency level, off when nothing pays, and the flags that reproduce it
result.py      the measured rows and the decision as one JSON-ready dict (cli/tune.py prints it as tables)
"""
