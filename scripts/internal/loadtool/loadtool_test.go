package loadtool

import (
	"context"
	"os"
	"testing"
	"time"
)

func TestSleepUntil(t *testing.T) {
	if err := SleepUntil(context.Background(), time.Now().Add(-time.Second)); err != nil {
		t.Fatalf("a moment past: %v, want nil at once", err)
	}
	start := time.Now()
	if err := SleepUntil(context.Background(), start.Add(20*time.Millisecond)); err != nil || time.Since(start) < 20*time.Millisecond {
		t.Fatalf("20 ms ahead: %v after %s", err, time.Since(start))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := SleepUntil(ctx, time.Now().Add(time.Hour)); err != context.Canceled {
		t.Fatalf("ctx cancelled: %v, want context.Canceled", err)
	}
}

func TestRSS(t *testing.T) {
	if n := RSS(os.Getpid()); n < 1<<20 {
		t.Fatalf("RSS of this test process: %d bytes, want at least 1 MiB", n)
	}
	if n := RSS(-1); n != 0 {
		t.Fatalf("RSS of no process: %d, want 0", n)
	}
}
