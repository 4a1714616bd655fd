"""Training methods, one module each (see hvd_lowcomm.registry for how they are found by name,
and hvd_lowcomm.methods.base for what each provides)."""
