"""HF models: loading them in the workers, scoring texts with a reward model, the driver's checks of a model
directory, and the tiny model the tests and the demo build."""
