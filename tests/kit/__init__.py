"""Helpers shared by the tests (stand-ins, waits, ports), one module per subject."""
