"""``millpond serve`` as a daemon from before streams of calls (for tests of the client's
fallback): PushBatchStream and SampleStream answer gRPC's UNIMPLEMENTED."""

import sys

from millpond_server import cli, service

if __name__ == "__main__":
    service.STREAMED.clear()  # no stream handlers are registered
    sys.exit(cli.main(sys.argv[1:]))
