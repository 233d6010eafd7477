"""The collectives (one block per primitive with its rules) and their uneven forms."""
