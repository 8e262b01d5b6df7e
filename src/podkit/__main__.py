from podkit.cli import main

raise SystemExit(main())
