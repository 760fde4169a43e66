from convcheck.cli.main import main

raise SystemExit(main())
