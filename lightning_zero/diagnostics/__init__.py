"""Diagnostics that never change a result: collective probes, the hang watchdog, the environment audit and
collective timing. Framework-free (torch only); the Lightning side is ``callbacks.diagnostics`` and the strategy."""
