"""`python -m embed_lib <command>`: the parser (`parser`), the shared flags (`args`), the commands (`commands`) and the
registry listing (`registry`)."""
from embed_lib._moved import package_getattr

__getattr__ = package_getattr(__name__, ["parser"])  # embed_lib.cli was a module in 0.1
