from embed_lib.cli import main

raise SystemExit(main())
