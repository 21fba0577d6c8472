"""Model code: torchtitan ``Module`` trees for the canon-titan model families."""
