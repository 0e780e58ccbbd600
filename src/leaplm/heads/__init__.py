"""Trained draft heads that read the target's hidden states: EAGLE (eagle_net) and Medusa (medusa_net)."""
