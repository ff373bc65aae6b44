"""Hardware profiles (TOML data files), shipped as package data."""
