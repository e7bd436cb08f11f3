package main

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"
)

// recordPanics returns an onPanic that records what it is given, and the record.
func recordPanics() (func(component, any), chan string) {
	got := make(chan string, 8)
	return func(c component, recovered any) { got <- c.String() + ": " + recovered.(string) }, got
}

func noPanic(t *testing.T) func(component, any) {
	return func(c component, r any) { t.Errorf("%s panicked: %v", c, r) }
}

// w is the component the tests' startStops carry: any one does.
var w = componentOutboxPoller

// stopWithin runs Stop in a goroutine, so a Stop that does not return fails
// the test instead of hanging it.
func stopWithin(t *testing.T, s *startStop, ctx context.Context) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- s.Stop(ctx) }()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: Stop did not return (%d goroutines running)", s.component, s.activeCount())
		return nil
	}
}

func (s *startStop) activeCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.active
}

func TestStartStopSecondStartIsANoOp(t *testing.T) {
	s := newStartStop(w, stopNow, noPanic(t))
	var prepared, ran atomic.Int32
	start := func() error {
		return s.start(context.Background(), func(context.Context) error { prepared.Add(1); return nil },
			func(ctx context.Context) { ran.Add(1); <-ctx.Done() })
	}
	if err := start(); err != nil {
		t.Fatal(err)
	}
	if err := start(); err != nil {
		t.Fatalf("second Start: %v", err)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatal(err)
	}
	if prepared.Load() != 1 || ran.Load() != 1 {
		t.Fatalf("two Starts prepared %d times and ran %d times, want once each", prepared.Load(), ran.Load())
	}
}

func TestStartStopStopBeforeStartAndTwice(t *testing.T) {
	s := newStartStop(w, stopSoft, noPanic(t))
	untilStopped := func(context.Context) { <-s.stopping() }
	steps := []struct {
		what string
		do   func() error
	}{
		{"Stop before Start", func() error { return stopWithin(t, s, context.Background()) }},
		{"Start after a Stop before Start", func() error { return s.start(context.Background(), nil, untilStopped) }},
		{"Stop", func() error { return stopWithin(t, s, context.Background()) }},
		{"second Stop", func() error { return stopWithin(t, s, context.Background()) }},
		{"restart once stopped", func() error { return s.start(context.Background(), nil, untilStopped) }}, // as River's services can
		{"Stop after the restart", func() error { return stopWithin(t, s, context.Background()) }},
	}
	for _, step := range steps {
		if err := step.do(); err != nil {
			t.Fatalf("%s: %v", step.what, err)
		}
	}
}

func TestStartStopPrepareErrorStartsNothing(t *testing.T) {
	s := newStartStop(w, stopNow, noPanic(t))
	boom := errors.New("dependency down")
	var ran atomic.Bool
	err := s.start(context.Background(), func(context.Context) error { return boom }, func(context.Context) { ran.Store(true) })
	if !errors.Is(err, boom) {
		t.Fatalf("Start returned %v, want the prepare error", err)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatal(err)
	}
	if ran.Load() {
		t.Fatal("run started although prepare failed")
	}
	// A failed Start leaves it startable.
	if err := s.start(context.Background(), nil, func(ctx context.Context) { <-ctx.Done() }); err != nil {
		t.Fatal(err)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A soft stop lets the goroutines finish what they hold, with their context
// still live, and Stop returns only after every one of them (run and the ones
// it started with goOwned) has returned.
func TestStartStopSoftStopWaitsForEveryGoroutine(t *testing.T) {
	s := newStartStop(w, stopSoft, noPanic(t))
	sawStop, release := make(chan struct{}), make(chan struct{})
	var ctxLiveAtStop, childStopped, runReturned atomic.Bool
	run := func(ctx context.Context) {
		child := s.goOwned(ctx, func(ctx context.Context) { <-ctx.Done(); childStopped.Store(true) })
		defer child.stop()
		<-s.stopping()
		ctxLiveAtStop.Store(ctx.Err() == nil)
		close(sawStop)
		<-release // "finishing the batch"
		runReturned.Store(true)
	}
	if err := s.start(context.Background(), nil, run); err != nil {
		t.Fatal(err)
	}
	stopped := make(chan error, 1)
	go func() { stopped <- s.Stop(context.Background()) }()
	<-sawStop
	// Stop cannot legally have returned while run is blocked: give a broken
	// Stop the time to show itself.
	select {
	case err := <-stopped:
		t.Fatalf("Stop returned (%v) while its goroutine was still running", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(release)
	if err := <-stopped; err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if !ctxLiveAtStop.Load() || !runReturned.Load() || !childStopped.Load() {
		t.Fatalf("ctx live at the soft stop %v, run returned %v, child stopped %v; want all true",
			ctxLiveAtStop.Load(), runReturned.Load(), childStopped.Load())
	}
}

// stopNow cancels the goroutines' context at once, with errStopped as cause.
func TestStartStopStopNowCancelsAtOnce(t *testing.T) {
	s := newStartStop(w, stopNow, noPanic(t))
	cause := make(chan error, 1)
	if err := s.start(context.Background(), nil, func(ctx context.Context) { <-ctx.Done(); cause <- context.Cause(ctx) }); err != nil {
		t.Fatal(err)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := <-cause; !errors.Is(err, errStopped) {
		t.Fatalf("cause %v, want errStopped", err)
	}
}

// When Stop's ctx ends before a soft stop is done, Stop cancels the
// goroutines' context (cause: ctx's cause), waits for them and returns that
// cause.
func TestStartStopCtxExpiryStopsHard(t *testing.T) {
	s := newStartStop(w, stopSoft, noPanic(t))
	var hardCause atomic.Value
	if err := s.start(context.Background(), nil, func(ctx context.Context) {
		<-ctx.Done() // ignores the soft stop: only the hard one ends it
		hardCause.Store(context.Cause(ctx))
	}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	err := stopWithin(t, s, ctx)
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errStillRunning) {
		t.Fatalf("Stop returned %v, want the deadline and nothing left running", err)
	}
	if c, _ := hardCause.Load().(error); !errors.Is(c, context.DeadlineExceeded) {
		t.Fatalf("the goroutine's context ended with %v, want Stop's deadline", c)
	}
	if n := s.activeCount(); n != 0 {
		t.Fatalf("%d goroutines still running after Stop returned", n)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatalf("Stop after a hard stop: %v", err)
	}
}

// A goroutine that ignores even the hard stop is not silently left: Stop says
// so, Start refuses while it runs, and a later Stop waits for it.
func TestStartStopGoroutineOutlivingTheHardStop(t *testing.T) {
	s := newStartStop(w, stopSoft, noPanic(t))
	release := make(chan struct{})
	if err := s.start(context.Background(), nil, func(context.Context) { <-release }); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := stopWithin(t, s, ctx)
	if !errors.Is(err, errStillRunning) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop returned %v, want errStillRunning and the deadline", err)
	}
	if err := s.start(context.Background(), nil, func(context.Context) {}); err == nil {
		t.Fatal("Start succeeded while the last run's goroutine was still running")
	}
	close(release)
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatalf("a Stop once the goroutine returned: %v", err)
	}
	if err := s.start(context.Background(), nil, func(context.Context) { <-s.stopping() }); err != nil {
		t.Fatalf("Start once stopped: %v", err)
	}
	if err := stopWithin(t, s, context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A panic in run or in a goroutine run started is recovered by startStop,
// handed to onPanic once each with the component's name, and Stop still
// returns.
func TestStartStopPanicGoesToOnPanicOnce(t *testing.T) {
	for _, where := range []string{"run", "child"} {
		t.Run(where, func(t *testing.T) {
			onPanic, got := recordPanics()
			s := newStartStop(w, stopSoft, onPanic)
			run := func(context.Context) { panic("bug in run") }
			if where == "child" {
				run = func(ctx context.Context) {
					defer s.goOwned(ctx, func(context.Context) { panic("bug in child") }).stop()
					<-s.stopping()
				}
			}
			if err := s.start(context.Background(), nil, run); err != nil {
				t.Fatal(err)
			}
			if err := stopWithin(t, s, context.Background()); err != nil {
				t.Fatalf("Stop after a panic: %v", err)
			}
			// Stop has returned, so every recovered panic has been handed over.
			close(got)
			var all []string
			for p := range got {
				all = append(all, p)
			}
			if want := "outboxPoller: bug in " + where; len(all) != 1 || all[0] != want {
				t.Fatalf("onPanic got %q, want once %q", all, want)
			}
		})
	}
}
