"""Model definitions (logical axes only; no mesh axis names here)."""
