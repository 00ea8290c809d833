"""Core of hyper_parallel: the plugin registry, optimizers and distributed helpers."""
