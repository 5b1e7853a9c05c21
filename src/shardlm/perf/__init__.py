"""Performance: FLOP counting, peaks and MFU."""
