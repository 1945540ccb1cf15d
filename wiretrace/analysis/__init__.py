"""wiretrace stage package."""
