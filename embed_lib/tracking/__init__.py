"""MLflow glue: `runs` (seed groups, provenance, stores), `registry` (log, register, load back) and its promotion
rule (`promotion`), the pyfunc model definitions ("models from code") of the adapter and of the served teacher,
and the teacher's registry side (`cross_encoder_registry`)."""
from embed_lib._moved import package_getattr

__getattr__ = package_getattr(__name__, ["runs"])  # embed_lib.tracking was a module in 0.1
