from embed_lib.cli import main
from embed_lib.cli_args import skip_exit_collection

skip_exit_collection()

raise SystemExit(main())
