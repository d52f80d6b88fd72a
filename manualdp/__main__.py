from .runners.cli import main

raise SystemExit(main())
