"""Storage without Trio: cache signatures, the .kvc format, the Disk interface (design §4)."""
