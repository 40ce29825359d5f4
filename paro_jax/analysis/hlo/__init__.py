"""Reading compiled HLO: its collectives (bytes, levels, counts per step) and their overlap."""
