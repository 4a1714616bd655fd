import sys

from hvd_lowcomm.elastic.launch import main

sys.exit(main())
