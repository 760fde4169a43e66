from convcheck.cli import main

raise SystemExit(main())
