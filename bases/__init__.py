"""Base models: the catalogue, the architectures LoRA trains on, where weights come from, and the
memory plan that says whether a base fits a device."""
