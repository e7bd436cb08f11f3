package main

import (
	"bufio"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"
)

// namedFiles is a repeatable NAME=PATH flag.
type namedFiles [][2]string

func (n *namedFiles) String() string { return fmt.Sprint(*n) }
func (n *namedFiles) Set(v string) error {
	name, path, ok := strings.Cut(v, "=")
	if !ok || name == "" || path == "" {
		return fmt.Errorf("want NAME=PATH, not %q", v)
	}
	*n = append(*n, [2]string{name, path})
	return nil
}

// errFailed is the report's verdict when a request failed: exit 1, not 2.
var errFailed = errors.New("requests failed")

func report(args []string, stdout io.Writer) error {
	fs := flag.NewFlagSet("report", flag.ContinueOnError)
	var results, logs namedFiles
	fs.Var(&results, "results", "NAME=FILE: the results of one load run (repeat: steady, roll)")
	fs.Var(&logs, "log", "INSTANCE=FILE: an instance's JSON log, whose drains the failures are joined to (repeat)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if len(results) == 0 {
		return errors.New("report needs at least one -results NAME=FILE")
	}
	var drains []drain
	for _, l := range logs {
		d, err := readDrains(l[0], l[1])
		if err != nil {
			return err
		}
		drains = append(drains, d...)
	}
	runs := make([]run, 0, len(results))
	for _, r := range results {
		rs, err := readResults(r[1])
		if err != nil {
			return fmt.Errorf("results %s: %w", r[0], err)
		}
		runs = append(runs, run{name: r[0], results: rs})
	}
	if failed := write(stdout, runs, drains); failed > 0 {
		return fmt.Errorf("%d %w", failed, errFailed)
	}
	return nil
}

// run is the results of one load run, by name.
type run struct {
	name    string
	results []result
}

// write prints the figures of each run, each drain's SIGTERM → exit, and
// the failed requests by drain step and connection, and says how many failed.
func write(w io.Writer, runs []run, drains []drain) (failed int) {
	for _, r := range runs {
		s := summarize(r.results)
		fmt.Fprintf(w, "%-8s requests %6d  failed %4d  p50 %s  p99 %s  resent by net/http on a new connection %d\n",
			r.name, s.sent, s.failed, ms(s.p50), ms(s.p99), s.resent)
		failed += s.failed
	}

	for _, d := range drains {
		took, linger := "did not exit", ""
		if !d.exited.IsZero() {
			took = fmt.Sprintf("%5d ms", d.exitTook().Milliseconds())
		}
		if d.lingerEnd != "" {
			linger = fmt.Sprintf("  (linger %d ms, ended %s)", d.linger.Milliseconds(), d.lingerEnd)
		}
		fmt.Fprintf(w, "%-8s SIGTERM → exit %s%s\n", d.instance, took, linger)
	}

	// Every failure is placed where it happened: at its end, when the client
	// saw the error or the failing status.
	var all []result
	for _, r := range runs {
		all = append(all, r.results...)
	}
	t := breakdown(all, drains)
	fmt.Fprintln(w, "failed requests by drain step (of the instance draining when the failure came), client connection, and who answered:")
	fmt.Fprintf(w, "  %-16s %6s %6s   %8s %6s %8s %9s\n", "step", "new", "reused", "draining", "other", "balancer", "no answer")
	for _, step := range t.steps {
		t.counts[step].row(w, step)
	}
	t.total.row(w, "total")

	const shown = 20
	for i, f := range t.failures {
		if i == shown {
			fmt.Fprintf(w, "  … and %d more\n", len(t.failures)-shown)
			break
		}
		r, p := f.result, f.placement
		where := p.step
		if p.instance != "" {
			where = p.instance + " " + p.step
		}
		what := fmt.Sprintf("status %d", r.Status)
		switch {
		case r.Error != "":
			what = r.Error
		case r.Server != "":
			what += " from " + r.Server + ": " + oneLine(r.Body)
		default:
			what += " from the load balancer: " + oneLine(r.Body)
		}
		fmt.Fprintf(w, "  failed at %s (%s, %s connection, %d conns tried, after %s): %s\n",
			r.End.Format("15:04:05.000"), where, conn(r.Reused), r.Conns, r.End.Sub(r.Start).Round(100*time.Microsecond), what)
	}
	return failed
}

// table is the failed requests counted by step.
type table struct {
	steps    []string // rows, in drain order: not draining, the steps, exit, exited
	counts   map[string]*count
	total    count
	failures []placed
}

// count is one row of the table: the failures by client connection, and
// again by who answered them.
type count struct {
	byConn   [2]int // new, reused
	bySource [4]int // the draining instance, another one, the balancer itself, nobody
}

// The answerers of a failed request, the columns of bySource.
const (
	fromDraining = iota // the instance whose drain the failure fell in
	fromOther           // an instance that was not draining: overload, a dependency
	fromBalancer        // HAProxy's own page (no X-Served-By): no server, or a server's connection failed
	fromNobody          // no answer at all: the client's connection failed or timed out
)

func (c *count) row(w io.Writer, name string) {
	fmt.Fprintf(w, "  %-16s %6d %6d   %8d %6d %8d %9d\n", name, c.byConn[0], c.byConn[1],
		c.bySource[fromDraining], c.bySource[fromOther], c.bySource[fromBalancer], c.bySource[fromNobody])
}

func (c *count) add(r result, p placement) {
	conn := 0
	if r.Reused {
		conn = 1
	}
	c.byConn[conn]++
	switch {
	case r.Error != "":
		c.bySource[fromNobody]++
	case r.Server == "":
		c.bySource[fromBalancer]++
	case r.Server == p.instance:
		c.bySource[fromDraining]++
	default:
		c.bySource[fromOther]++
	}
}

type placed struct {
	result
	placement
}

// breakdown counts the failed requests by the step they fell in. Its rows
// are every stretch of every drain, in order, even with nothing in them: a
// table of zeros says the drain lost nothing anywhere.
func breakdown(results []result, drains []drain) table {
	t := table{steps: []string{stepServing}, counts: map[string]*count{}}
	for _, d := range drains {
		for _, s := range d.spans() {
			if !slices.Contains(t.steps, s.name) {
				t.steps = append(t.steps, s.name)
			}
		}
	}
	if len(drains) == 0 {
		t.steps = append(t.steps, stepExit, stepDown)
	}
	for _, step := range t.steps {
		t.counts[step] = &count{}
	}
	for _, r := range results {
		if !r.failed() {
			continue
		}
		p := place(drains, r.End)
		t.counts[p.step].add(r, p)
		t.total.add(r, p)
		t.failures = append(t.failures, placed{r, p})
	}
	slices.SortFunc(t.failures, func(a, b placed) int { return a.End.Compare(b.End) })
	return t
}

type summary struct {
	sent, failed, resent int
	p50, p99             time.Duration
}

// summarize counts a run and takes its latency percentiles over every
// request, failed ones included, as vegeta does.
func summarize(results []result) summary {
	s := summary{sent: len(results)}
	lat := make([]time.Duration, 0, len(results))
	for _, r := range results {
		if r.failed() {
			s.failed++
		}
		if r.Conns > 1 {
			s.resent++
		}
		lat = append(lat, r.End.Sub(r.Start))
	}
	slices.Sort(lat)
	s.p50, s.p99 = percentile(lat, 50), percentile(lat, 99)
	return s
}

// percentile of sorted durations, nearest rank; -1 when there are none.
func percentile(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return -1
	}
	i := (len(sorted)*p + 99) / 100 // ceil(n·p/100), 1-based
	return sorted[max(i, 1)-1]
}

func ms(d time.Duration) string {
	if d < 0 {
		return "     - ms"
	}
	return fmt.Sprintf("%6.2f ms", float64(d)/float64(time.Millisecond))
}

// oneLine is a body fit for one line of the report.
func oneLine(body string) string { return strings.Join(strings.Fields(body), " ") }

func conn(reused bool) string {
	if reused {
		return "reused"
	}
	return "new"
}

func readResults(path string) ([]result, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading: %w", err)
	}
	defer f.Close()
	var results []result
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var r result
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("line %d of %s: %w", len(results)+1, path, err)
		}
		results = append(results, r)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return results, nil
}
