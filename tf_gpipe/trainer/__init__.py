"""Training library: learner and the train / eval / inspect loop (tools/trainer.py is the CLI)."""
