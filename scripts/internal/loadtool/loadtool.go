// Package loadtool is what the Go load tools under scripts/ share (each is a
// package main of its own there). The service does not import it: it stays
// one flat package main, with its own sleepCtx.
package loadtool

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"time"
)

// SleepUntil waits for the moment at or for the end of ctx (then ctx's error).
// A deadline on a child of ctx is the timer.
func SleepUntil(ctx context.Context, at time.Time) error {
	wait, cancel := context.WithDeadline(ctx, at)
	defer cancel()
	<-wait.Done()
	return ctx.Err()
}

// RSS is the resident set (VmRSS) of process pid in bytes; 0 once it is gone.
func RSS(pid int) int64 {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for line := range bytes.Lines(status) {
		if rest, ok := bytes.CutPrefix(line, []byte("VmRSS:")); ok {
			if f := bytes.Fields(rest); len(f) > 0 { // "  123456 kB"
				kb, _ := strconv.ParseInt(string(f[0]), 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}
