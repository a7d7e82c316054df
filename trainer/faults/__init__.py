"""Faults: the step's guards (a NaN or a spike skipped), the watchdog (a hang made an error), fault
tolerance across replica groups (torchft), and the faults the tests inject."""
