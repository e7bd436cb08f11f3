package main

import (
	"strings"
	"testing"
)

// The open-file limit must leave room for the API's connection cap: below it,
// accepts fail with EMFILE while the cap still has room.
func TestFDLimitAgainstTheConnectionCap(t *testing.T) {
	for _, c := range []struct {
		fds      uint64
		maxConns uint
		warns    bool
	}{
		{fds: 1 << 20, maxConns: 8192},
		{fds: 8192 + minOpenFiles, maxConns: 8192},
		{fds: 8192 + minOpenFiles - 1, maxConns: 8192, warns: true},
		{fds: 4096, maxConns: 8192, warns: true},
		{fds: 1024, maxConns: 0}, // no cap: nothing to compare
	} {
		got := fdsForConnCap(c.fds, c.maxConns)
		if (got != "") != c.warns {
			t.Errorf("fd limit %d, cap %d: warning %q, want one: %v", c.fds, c.maxConns, got, c.warns)
		}
		if c.warns && !strings.Contains(got, "KUMIKO_API_MAX_CONNS") {
			t.Errorf("fd limit %d, cap %d: the warning %q does not name the setting", c.fds, c.maxConns, got)
		}
	}
}
