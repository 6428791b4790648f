"""A run: the train and eval steps, start-up (restore or initialise), the training loop and its
cadence, validation and evaluation, stopping on signals, and the memory estimate of a config.

Floor 5: may import every subpackage below it.
"""
