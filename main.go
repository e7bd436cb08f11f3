// Command kumiko-lifecycle-demo is a reference service that boots in 16
// deterministic phases, tells the truth on its health endpoints, drains on
// SIGTERM without losing a request, and recovers from crashes. See README.md.
package main

import (
	"context"
	"fmt"
	"os"
)

func main() {
	if err := run(context.Background(), os.Args, os.Getenv, os.Environ(), os.Stdout, os.Stderr); err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", serviceName, err)
		os.Exit(1)
	}
}
