from embed_lib.cli.args import skip_exit_collection
from embed_lib.cli.parser import main

skip_exit_collection()

raise SystemExit(main())
