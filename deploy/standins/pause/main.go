// Command pause is the STAND-IN for registry.k8s.io/pause, built by
// scripts/k8s-smoke.sh where no image registry answers: the process that
// holds a pod's namespaces. Like the real pause it does nothing but wait for
// SIGINT or SIGTERM, and, being PID 1 of the pod, reaps orphaned children.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			return
		}
		// Reap every child that has exited (several SIGCHLDs may arrive as one).
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
