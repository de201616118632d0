from passerelle.cli import main

raise SystemExit(main())
