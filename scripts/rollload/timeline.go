package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"time"
)

// A drain is one instance's way from its stop request to its exit, step by
// step, as its JSON log tells it (shutdown.go): event=shutdown_requested
// starts it, each step logs one line when it ends (step=<name>,
// duration_ms), and event=exit ends it. After the exit the instance is down
// until a new process of it logs state_changed to=ready.
type drain struct {
	instance  string
	requested time.Time // event=shutdown_requested: the signal, as the process saw it
	steps     []span    // in order, back to back from requested to exited
	exited    time.Time // event=exit; zero when the log ends inside the drain
	readyAt   time.Time // the next process's state_changed to=ready; zero when none came
	linger    time.Duration
	lingerEnd string // event=linger_ended's ended: quiet or max
}

// span is a named stretch of a drain: a step of shutdown.go, or one of the
// stretches around them (stepExit, stepDown).
type span struct {
	name       string
	start, end time.Time
}

// The stretches a failure can fall in that are no step of shutdown.go.
const (
	stepServing = "not draining" // no instance was between its stop request and its next ready
	stepExit    = "exit"         // after the last step, until event=exit
	stepDown    = "exited"       // the process is gone, its successor not ready yet
)

// logLine is the part of a JSON log line a drain is made of.
type logLine struct {
	Time     time.Time `json:"time"`
	Event    string    `json:"event"`
	Step     string    `json:"step"`
	Duration int64     `json:"duration_ms"`
	Ended    string    `json:"ended"`
	To       string    `json:"to"`
}

// readDrains reads the drains in one instance's log.
func readDrains(instance, path string) ([]drain, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading the log of %s: %w", instance, err)
	}
	defer f.Close()
	drains, err := parseDrains(instance, f)
	if err != nil {
		return nil, fmt.Errorf("reading the log of %s (%s): %w", instance, path, err)
	}
	return drains, nil
}

// parseDrains turns a log into drains. Lines that are no JSON (a panic's
// stack, a line of the Go runtime) are skipped: they carry no step.
func parseDrains(instance string, r io.Reader) ([]drain, error) {
	var drains []drain
	var cur *drain // the drain under way, or the last one while its instance is down
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		var l logLine
		if json.Unmarshal(sc.Bytes(), &l) != nil || l.Time.IsZero() {
			continue
		}
		switch {
		case l.Event == "shutdown_requested":
			drains = append(drains, drain{instance: instance, requested: l.Time})
			cur = &drains[len(drains)-1]
		case cur == nil:
			// before the first drain: serving
		case l.Event == "state_changed" && l.To == "ready" && !cur.exited.IsZero():
			cur.readyAt = l.Time
			cur = nil
		case !cur.exited.IsZero():
			// the next process booting
		case l.Event == "exit":
			cur.exited = l.Time
		case l.Event == "linger_ended":
			cur.lingerEnd = l.Ended
		case l.Step != "":
			start := cur.requested
			if n := len(cur.steps); n > 0 {
				start = cur.steps[n-1].end
			}
			cur.steps = append(cur.steps, span{name: l.Step, start: start, end: l.Time})
			if l.Step == "linger" {
				cur.linger = time.Duration(l.Duration) * time.Millisecond
			}
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return drains, nil
}

// spans is the drain as stretches, back to back: its steps, then until
// the exit line, then down until its successor is ready. A drain the log
// leaves unfinished runs on to the end of time.
func (d drain) spans() []span {
	forever := time.Unix(1<<62, 0)
	spans := append([]span(nil), d.steps...)
	last := d.requested
	if n := len(spans); n > 0 {
		last = spans[n-1].end
	}
	if d.exited.IsZero() {
		return append(spans, span{name: stepExit, start: last, end: forever})
	}
	spans = append(spans, span{name: stepExit, start: last, end: d.exited})
	ready := d.readyAt
	if ready.IsZero() {
		ready = forever
	}
	return append(spans, span{name: stepDown, start: d.exited, end: ready})
}

// exitTook is SIGTERM → exit as the process measured it; zero when it did not exit.
func (d drain) exitTook() time.Duration {
	if d.exited.IsZero() {
		return 0
	}
	return d.exited.Sub(d.requested)
}

// placement is where a moment fell: the instance that was draining then (""
// when none was) and the stretch of its drain.
type placement struct {
	instance, step string
}

// place finds the drain a moment fell in. A moment at a boundary belongs to
// the stretch that ends there: a step's line is logged as it ends. When two
// drains overlap (the script never stops the second instance before the
// first is back), the one that began first wins.
func place(drains []drain, at time.Time) placement {
	var best *drain
	var step string
	for i := range drains {
		d := &drains[i]
		if at.Before(d.requested) || (best != nil && !d.requested.Before(best.requested)) {
			continue
		}
		for _, s := range d.spans() {
			if !at.After(s.end) {
				best, step = d, s.name
				break
			}
		}
	}
	if best == nil {
		return placement{step: stepServing}
	}
	return placement{instance: best.instance, step: step}
}
