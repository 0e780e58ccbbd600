"""Recipes that train leaplm's embedded model family: tokenizer, pretraining, distillation, evaluation."""
