"""What users type: `%gpumem`, `%%oomguard` / `%oomguard on|off`, `%freecuda`, their arguments, the
extension's load/unload and per-shell state, and running a cell as IPython does."""
