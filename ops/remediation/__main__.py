"""python -m ops.remediation --policy FILE [--check]"""

from .service import main

raise SystemExit(main())
