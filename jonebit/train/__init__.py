"""Training-step builders and loops."""
