package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// 4. (issue 6) The rolling deploy runs with a short load and fails when any
// request fails: two instances behind HAProxy, each stopped with SIGTERM and
// started again while vegeta sends requests through the load balancer.
func TestRollingDeployLosesNoRequest(t *testing.T) {
	for _, bin := range []string{"haproxy", "vegeta", "redis-server", "curl"} {
		if _, err := exec.LookPath(bin); err != nil {
			failOrSkip(t, &missingServiceError{what: bin, install: "scripts/install-deps.sh"})
		}
	}
	cmd := exec.Command("bash", "scripts/rolling-deploy.sh")
	// The script creates and removes its directory; the postgres user must be
	// able to reach it, which t.TempDir (mode 0700) would not allow.
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("kumiko-roll-%d", os.Getpid()))
	cmd.Env = append(os.Environ(), "RATE=200", "STEADY=2s", "ROLL_DIR="+dir)
	for _, port := range []string{"LB_PORT", "PG_PORT", "REDIS_PORT", "API_PORT1", "API_PORT2", "OPS_PORT1", "OPS_PORT2"} {
		cmd.Env = append(cmd.Env, port+"="+portOf(freeTCPAddr(t)))
	}
	out, err := cmd.CombinedOutput()
	t.Logf("%s", lastLines(string(out), 4))
	if err != nil {
		t.Fatalf("rolling deploy: %v\n%s", err, lastLines(string(out), 30))
	}
	if !strings.Contains(string(out), "ok: no request failed") {
		t.Fatalf("no verdict in the output:\n%s", lastLines(string(out), 30))
	}
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
