"""One router module per resource: completions, chat completions, models (+ health)."""
