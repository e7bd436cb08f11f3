// Command rollload is the load and the verdict of scripts/rolling-deploy.sh.
//
// attack sends requests at a constant rate through the load balancer on a
// pool of keep-alive connections and writes, for each request, when it
// started and ended, its status or error, and whether its connection was new
// or reused (vegeta cannot tell the last). report joins the failed requests to
// the drains in the instances' JSON logs and prints them by drain step and
// connection, zeros included, with each instance's SIGTERM → exit.
//
//	rollload attack -rate 1000 -targets targets.json -out roll.jsonl   # until SIGINT
//	rollload report -results steady=steady.jsonl -results roll=roll.jsonl -log app1=app1.log -log app2=app2.log
//
// report exits 1 when a request failed, 2 when it could not report.
package main

import (
	"errors"
	"fmt"
	"os"
)

func main() {
	err := errors.New("usage: rollload attack|report [flags]")
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "attack":
			err = attack(os.Args[2:])
		case "report":
			err = report(os.Args[2:], os.Stdout)
		}
	}
	switch {
	case err == nil:
	case errors.Is(err, errFailed):
		fmt.Fprintln(os.Stderr, "rollload:", err)
		os.Exit(1)
	default:
		fmt.Fprintln(os.Stderr, "rollload:", err)
		os.Exit(2)
	}
}
