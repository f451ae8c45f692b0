"""The trainer (trainer.py) and its phases: the step batch, the old-policy pass, advantages, the update, metrics and
checkpoints. docs/architecture.md says which file does what."""
