"""Drafters: the interface the loop drives (`base`, the draft tree), the LaSpec drafter and its block drafting,
independent HF models as drafters, and the branches added to a tree (context lookup, the datastore, visual-token
selection)."""
