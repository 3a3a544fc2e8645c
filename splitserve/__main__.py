from splitserve.services.cli import main

raise SystemExit(main())
