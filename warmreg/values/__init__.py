"""Values: the errors, compile keys and platforms every layer uses (imports no other layer)."""
