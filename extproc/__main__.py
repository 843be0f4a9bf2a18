from extproc.app.cli import main

raise SystemExit(main())
