from rlhf.cli.main import main

raise SystemExit(main())
