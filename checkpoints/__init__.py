"""Checkpoints: where their files live (local or S3) and how they are laid out, this machine's
cache of them, their rows, retention, and merging an adapter into its base."""
