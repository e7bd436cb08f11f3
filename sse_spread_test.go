package main

import (
	"slices"
	"testing"
	"time"
)

// The window grows by a step per stream, up to the setting and never past
// what is left of the drain budget; with the spread off it is 0.
func TestSpreadWindow(t *testing.T) {
	for _, tc := range []struct {
		name               string
		n                  int
		spread, step, left time.Duration
		want               time.Duration
	}{
		{"one stream: no wait", 1, 10 * time.Second, 2 * time.Millisecond, 30 * time.Second, 2 * time.Millisecond},
		{"grows with the streams", 500, 10 * time.Second, 2 * time.Millisecond, 30 * time.Second, time.Second},
		{"up to the setting", 20000, 10 * time.Second, 2 * time.Millisecond, 30 * time.Second, 10 * time.Second},
		{"within what is left of the drain", 5000, 10 * time.Second, 2 * time.Millisecond, 3 * time.Second, 3 * time.Second},
		{"drain budget spent", 5000, 10 * time.Second, 2 * time.Millisecond, -time.Second, 0},
		{"off", 5000, 0, 2 * time.Millisecond, 30 * time.Second, 0},
		{"no streams", 0, 10 * time.Second, 2 * time.Millisecond, 30 * time.Second, 0},
		{"a huge step does not overflow", 20000, 10 * time.Second, 1000 * time.Hour, 30 * time.Second, 10 * time.Second},
	} {
		if got := spreadWindow(tc.n, tc.spread, tc.step, tc.left); got != tc.want {
			t.Errorf("%s: spreadWindow(%d, %s, %s, %s) = %s, want %s", tc.name, tc.n, tc.spread, tc.step, tc.left, got, tc.want)
		}
	}
}

// The plan closes the streams over the first half of the window and aims
// their reconnects evenly over all of it: every tenth of the window gets a
// tenth of the clients. Off (window 0), everyone goes at once with the base hint.
func TestSpreadGoodbyes(t *testing.T) {
	const n, base, window = 1000, time.Second, 10 * time.Second
	plan := spreadGoodbyes(n, base, window)
	if !slices.IsSortedFunc(plan, func(a, b goodbye) int { return int(a.at - b.at) }) {
		t.Fatal("the plan is not in the order of its goodbyes")
	}
	var perTenth [10]int
	hints := map[int64]bool{}
	for _, g := range plan {
		if g.at < 0 || g.at >= window/2 {
			t.Fatalf("a goodbye at %s, outside the first half of the %s window", g.at, window)
		}
		if g.retry < base || g.retry > base+window/2 {
			t.Fatalf("a retry hint of %s, outside [%s, %s]", g.retry, base, base+window/2)
		}
		back := g.at + g.retry - base // when the client comes back, after the base hint
		perTenth[back*10/window]++
		hints[g.retry.Milliseconds()] = true
	}
	for _, got := range perTenth {
		if got != n/10 {
			t.Errorf("reconnects per tenth of the window: %v, want %d each", perTenth, n/10)
			break
		}
	}
	if len(hints) < n/2 {
		t.Errorf("%d distinct retry hints (ms) among %d goodbyes: not jittered", len(hints), n)
	}

	for _, g := range spreadGoodbyes(5, base, 0) {
		if g.at != 0 || g.retry != base {
			t.Errorf("with the spread off: %+v, want every goodbye at once with the base hint", g)
		}
	}
}
