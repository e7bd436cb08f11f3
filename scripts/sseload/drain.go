package main

// The drain mode (-drain): N streams on the first instance, SIGTERM, and
// every client moves to the next instance in -api once its goodbye's retry
// hint has passed, resuming with Last-Event-ID, as a browser's EventSource
// does. What it measures is what the survivor goes through: how many streams
// it accepts per 100 ms, its CPU, how long a client waits from its goodbye
// to its new stream, how often it is told too_many_streams, and whether any
// client missed or got twice an order posted meanwhile.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kumiko/kumiko-lifecycle-demo/scripts/internal/loadtool"
)

// drainRun is one drain measurement.
type drainRun struct {
	hosts   []string // host:port of each instance; streams start on hosts[0]
	pid     int      // the instance drained
	survPid int      // the instance they move to (its CPU)
	streams int
	rate    int // orders per second, posted to the last instance all along

	start   time.Time      // SIGTERM
	created []atomic.Bool  // order k (its totalCents) was answered 201
	posted  atomic.Int64   // orders asked for: the highest k
	moved   atomic.Int64   // clients with a stream on another instance
	noBye   atomic.Int64   // streams that ended without a goodbye (force-closed)
	refused sync.Map       // error code → *atomic.Int64: non-200 answers to a reconnect
	tries   []atomic.Int64 // reconnect attempts per 100 ms since SIGTERM: what the survivor is asked
	opens   []atomic.Int64 // new streams on the survivor per 100 ms since SIGTERM: what it answered
	byes    []atomic.Int64 // goodbyes received per 100 ms since SIGTERM
	latency histogram      // goodbye → new stream open, refusals on the way included
	queued  histogram      // beyond the retry hint: what the survivor made the client wait
	hints   sync.Map       // retry hint (ms) → struct{}
	clients []*drainClient
}

// drainBuckets is how many 100 ms buckets the run records: 5 minutes.
const drainBuckets = 3000

// maxOrders bounds the orders one run posts (one bit each per client).
const maxOrders = 1 << 16

func runDrain(api string, pid, survPid, streams, rate int) error {
	var hosts []string
	for _, a := range strings.Split(api, ",") {
		u, err := url.Parse(a)
		if err != nil || u.Host == "" {
			return fmt.Errorf("-api %q: want base URLs, comma-separated", api)
		}
		hosts = append(hosts, u.Host)
	}
	if len(hosts) < 2 || pid == 0 || survPid == 0 || rate < 1 {
		return errors.New("-drain needs two -api URLs, -pid (the instance drained), -survivor-pid and a -rate of 1 or more")
	}
	d := &drainRun{hosts: hosts, pid: pid, survPid: survPid, streams: streams, rate: rate,
		created: make([]atomic.Bool, maxOrders), tries: make([]atomic.Int64, drainBuckets), opens: make([]atomic.Int64, drainBuckets),
		byes: make([]atomic.Int64, drainBuckets)}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var running sync.WaitGroup
	defer running.Wait() // after cancel: every client closes its stream and returns
	openStart := time.Now()
	for i := range streams {
		c := &drainClient{d: d}
		conn, _, _, err := c.dial(hosts[0])
		if err != nil {
			cancel()
			return fmt.Errorf("opening stream %d of %d: %w", i+1, streams, err)
		}
		d.clients = append(d.clients, c)
		running.Go(func() { c.run(ctx, conn) })
	}
	fmt.Printf("streams %d on %s (opened in %s), orders at %d/s to %s\n", streams, hosts[0],
		time.Since(openStart).Round(time.Millisecond), rate, hosts[len(hosts)-1])

	postCtx, stopPosting := context.WithCancel(ctx)
	posting := make(chan struct{})
	go func() { defer close(posting); d.post(postCtx, hosts[len(hosts)-1]) }()
	defer func() { stopPosting(); <-posting }()
	time.Sleep(time.Second) // every stream has seen orders before the drain begins

	cpu := newCPUSampler(survPid, 250*time.Millisecond)
	d.start = time.Now()
	if err := syscall.Kill(pid, syscall.SIGTERM); err != nil {
		return fmt.Errorf("SIGTERM: %w", err)
	}
	var exitTook time.Duration
	for deadline := time.Now().Add(2 * time.Minute); ; time.Sleep(5 * time.Millisecond) {
		if exitTook == 0 && syscall.Kill(pid, 0) != nil {
			exitTook = time.Since(d.start)
		}
		if (exitTook > 0 && d.moved.Load() == int64(streams)) || time.Now().After(deadline) {
			break
		}
	}
	movedTook := time.Since(d.start)
	time.Sleep(time.Second) // orders after the last move reach every client on its new stream
	stopPosting()
	<-posting
	cpuPeak, cpuMean := cpu.stop()

	missed, repeated := d.check(20 * time.Second)
	cancel()

	p50, _ := d.latency.pct(50)
	p99, n := d.latency.pct(99)
	pmax, _ := d.latency.pct(100)
	q99, _ := d.queued.pct(99)
	firstBye, lastBye, byePeak := spreadOf(d.byes)
	firstOpen, lastOpen, openPeak := spreadOf(d.opens)
	_, lastTry, tryPeak := spreadOf(d.tries)
	var hints []int
	d.hints.Range(func(k, _ any) bool { hints = append(hints, k.(int)); return true })
	slices.Sort(hints)
	fmt.Printf("SIGTERM → exit  %s; every client moved in %s (%d of %d)\n", exitTook.Round(time.Millisecond),
		movedTook.Round(time.Millisecond), d.moved.Load(), streams)
	if len(hints) > 0 {
		fmt.Printf("goodbyes        +%d…%d ms after SIGTERM, peak %d per 100 ms; retry hints %d…%d ms (%d distinct)\n",
			firstBye, lastBye, byePeak, hints[0], hints[len(hints)-1], len(hints))
	}
	fmt.Printf("survivor        asked for streams at up to %d/s (per 100 ms), per second from SIGTERM: %v\n",
		tryPeak*10, perSecond(d.tries, lastTry))
	fmt.Printf("                opened streams +%d…%d ms, peak %d/s (per 100 ms), per second: %v\n",
		firstOpen, lastOpen, openPeak*10, perSecond(d.opens, lastOpen))
	fmt.Printf("                CPU peak %.0f%% of a core (per 250 ms), %.0f%% on average\n", cpuPeak, cpuMean)
	fmt.Printf("reconnect       goodbye → new stream p50 %.0f ms, p99 %.0f ms, max %.0f ms (%d); beyond the hint p99 %.0f ms\n",
		p50, p99, pmax, n, q99)
	var refused []string
	tooMany, refusals := int64(0), int64(0)
	d.refused.Range(func(k, v any) bool {
		n := v.(*atomic.Int64).Load()
		refused = append(refused, fmt.Sprintf("%s %d", k, n))
		refusals += n
		if k == "too_many_streams" {
			tooMany = n
		}
		return true
	})
	fmt.Printf("refused         too_many_streams %d; all refusals: %v; streams ended without a goodbye %d\n", tooMany, refused, d.noBye.Load())
	fmt.Printf("events          %d orders; missed %d, repeated %d (across all clients)\n", d.posted.Load(), missed, repeated)
	// One line to collect into a table.
	fmt.Printf("RESULT attempt_peak_per_s=%d accept_peak_per_s=%d cpu_peak_pct=%.0f reconnect_p99_ms=%.0f beyond_hint_p99_ms=%.0f too_many_streams=%d refused=%d missed=%d repeated=%d exit_ms=%d\n",
		tryPeak*10, openPeak*10, cpuPeak, p99, q99, tooMany, refusals, missed, repeated, exitTook.Milliseconds())
	return nil
}

// spreadOf is the first and last non-empty 100 ms bucket (ms) and the largest.
func spreadOf(buckets []atomic.Int64) (first, last, peak int64) {
	first = -1
	for i := range buckets {
		n := buckets[i].Load()
		if n == 0 {
			continue
		}
		if first < 0 {
			first = int64(i) * 100
		}
		last, peak = int64(i)*100+100, max(peak, n)
	}
	return max(first, 0), last, peak
}

// perSecond sums the 100 ms buckets into seconds, up to ms.
func perSecond(buckets []atomic.Int64, ms int64) []int64 {
	out := make([]int64, (ms+999)/1000)
	for i := range min(len(buckets), int(ms/100)) {
		out[i/10] += buckets[i].Load()
	}
	return out
}

func (d *drainRun) bucket(at time.Time) int {
	return min(drainBuckets-1, max(0, int(at.Sub(d.start)/(100*time.Millisecond))))
}

// post creates orders at d.rate until ctx ends; order k costs k cents, so
// every client can tell which order an event is from its totalCents alone.
func (d *drainRun) post(ctx context.Context, host string) {
	client := &http.Client{Timeout: 10 * time.Second}
	var wg sync.WaitGroup
	defer wg.Wait()
	// An open model, as rollload's: order i leaves at begin + i/rate whether
	// or not the earlier ones have answered.
	interval, begin := time.Second/time.Duration(d.rate), time.Now()
	for i := 1; ; i++ {
		if loadtool.SleepUntil(ctx, begin.Add(time.Duration(i)*interval)) != nil {
			return
		}
		k := d.posted.Add(1)
		if k >= maxOrders {
			return
		}
		wg.Go(func() {
			body := fmt.Sprintf(`{"customer":"load","items":[{"sku":"tea","qty":1,"priceCents":%d}]}`, k)
			resp, err := client.Post("http://"+host+"/api/orders", "application/json", strings.NewReader(body))
			if err != nil {
				return
			}
			resp.Body.Close()
			if resp.StatusCode == http.StatusCreated {
				d.created[k].Store(true)
			}
		})
	}
}

// check waits until every client holds every order created, or until
// timeout, and counts what is missing and what came twice.
func (d *drainRun) check(timeout time.Duration) (missed, repeated int64) {
	count := func() (missed, repeated int64) {
		last := d.posted.Load()
		for _, c := range d.clients {
			c.mu.Lock()
			for k := int64(1); k <= last && k < maxOrders; k++ {
				if d.created[k].Load() && !c.has(k) {
					missed++
				}
			}
			repeated += c.repeated
			c.mu.Unlock()
		}
		return missed, repeated
	}
	for deadline := time.Now().Add(timeout); ; time.Sleep(100 * time.Millisecond) {
		if missed, repeated = count(); missed == 0 || time.Now().After(deadline) {
			return missed, repeated
		}
	}
}

// drainClient is one EventSource-like client.
type drainClient struct {
	d *drainRun

	mu       sync.Mutex
	seen     []uint64 // bit k: order k arrived
	repeated int64
	lastID   int64         // the last event id: Last-Event-ID on a reconnect
	retry    time.Duration // the last retry: hint
	bye      time.Time     // when the goodbye arrived, zero until then
}

func (c *drainClient) has(k int64) bool {
	return int(k/64) < len(c.seen) && c.seen[k/64]&(1<<(k%64)) != 0
}

// run reads the stream it was given; when it ends, it waits out the retry
// hint and opens a new one on the next instance, resuming after its last
// event, until ctx ends.
func (c *drainClient) run(ctx context.Context, conn net.Conn) {
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer func() { stop(); conn.Close() }()
	host, moved := 0, false
	for {
		c.read(conn)
		if ctx.Err() != nil {
			return
		}
		c.mu.Lock()
		bye, retry := c.bye, c.retry
		c.mu.Unlock()
		if bye.IsZero() {
			bye = time.Now() // ended without a goodbye (force-closed): a client retries all the same
			c.d.noBye.Add(1)
		} else {
			c.d.byes[c.d.bucket(bye)].Add(1)
			c.d.hints.Store(int(retry.Milliseconds()), struct{}{})
		}
		// The next instance; a refused connection moves on to the one after,
		// a refusal by the instance itself (503, 429) is tried there again.
		host = (host + 1) % len(c.d.hosts)
		for due := bye.Add(retry); ; {
			if err := loadtool.SleepUntil(ctx, due); err != nil {
				return
			}
			c.d.tries[c.d.bucket(time.Now())].Add(1)
			next, code, retryAfter, err := c.dial(c.d.hosts[host])
			if err == nil {
				now := time.Now()
				c.d.latency.add(now.Sub(bye))
				c.d.queued.add(max(0, now.Sub(bye.Add(retry))))
				c.d.opens[c.d.bucket(now)].Add(1)
				if !moved {
					c.d.moved.Add(1)
					moved = true
				}
				stop()
				conn, stop = next, context.AfterFunc(ctx, func() { next.Close() })
				break
			}
			counter, _ := c.d.refused.LoadOrStore(code, new(atomic.Int64))
			counter.(*atomic.Int64).Add(1)
			if code == "connect" {
				host = (host + 1) % len(c.d.hosts)
			}
			due = time.Now().Add(max(retryAfter, retry)) // as an EventSource: again after the hint
		}
		c.mu.Lock()
		c.bye = time.Time{}
		c.mu.Unlock()
	}
}

// dial opens a stream on host, resuming after the last event seen. A
// refusal comes back as its error code (too_many_streams, unavailable, a
// connection error) and its Retry-After.
func (c *drainClient) dial(host string) (conn net.Conn, code string, retryAfter time.Duration, err error) {
	conn, err = net.DialTimeout("tcp", host, 5*time.Second)
	if err != nil {
		return nil, "connect", 0, err
	}
	c.mu.Lock()
	resume := ""
	if c.lastID != 0 {
		resume = fmt.Sprintf("Last-Event-ID: %d\r\n", c.lastID)
	}
	c.mu.Unlock()
	fmt.Fprintf(conn, "GET /api/events HTTP/1.1\r\nHost: %s\r\nAccept: text/event-stream\r\n%s\r\n", host, resume)
	conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReaderSize(conn, readBuffer)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		conn.Close()
		return nil, "read", 0, err
	}
	if resp.StatusCode != http.StatusOK {
		var body struct {
			Error struct{ Code string } `json:"error"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&body)
		conn.Close()
		secs, _ := strconv.Atoi(resp.Header.Get("Retry-After"))
		return nil, cmpOr(body.Error.Code, strconv.Itoa(resp.StatusCode)), time.Duration(secs) * time.Second,
			fmt.Errorf("HTTP %d %s", resp.StatusCode, body.Error.Code)
	}
	conn.SetReadDeadline(time.Time{})
	return bufferedConn{Conn: conn, r: resp.Body}, "", 0, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// read takes frames off the stream until it ends.
func (c *drainClient) read(conn net.Conn) {
	buf := make([]byte, readBuffer)
	have := 0
	for {
		n, err := conn.Read(buf[have:])
		have += n
		if end := bytes.LastIndex(buf[:have], []byte("\n\n")); end >= 0 {
			c.frames(buf[:end+2], time.Now())
			have = copy(buf, buf[end+2:have])
		}
		if err != nil || have == len(buf) {
			return
		}
	}
}

var (
	totalCents = []byte(`"totalCents":`)
	shutdownEv = []byte("event: shutdown\n")
)

// frames takes in a run of whole frames, received at now.
func (c *drainClient) frames(frames []byte, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(frames) > 0 {
		frame, rest, _ := bytes.Cut(frames, []byte("\n\n"))
		frames = rest
		for line := range bytes.SplitSeq(frame, []byte("\n")) {
			switch {
			case bytes.HasPrefix(line, []byte("id: ")):
				c.lastID, _ = strconv.ParseInt(string(line[4:]), 10, 64)
			case bytes.HasPrefix(line, []byte("retry: ")):
				ms, _ := strconv.Atoi(string(line[7:]))
				c.retry = time.Duration(ms) * time.Millisecond
			}
		}
		if bytes.Contains(frame, shutdownEv) {
			c.bye = now
		}
		if _, after, ok := bytes.Cut(frame, totalCents); ok {
			end := bytes.IndexAny(after, ",}")
			k, err := strconv.ParseInt(string(after[:max(end, 0)]), 10, 64)
			if err != nil || k <= 0 || k >= maxOrders {
				continue
			}
			for int(k/64) >= len(c.seen) {
				c.seen = append(c.seen, 0)
			}
			if c.has(k) {
				c.repeated++
			}
			c.seen[k/64] |= 1 << (k % 64)
		}
	}
}

// cpuSampler reads a process's CPU time every period: the peak and the mean
// share of one core between its start and stop.
type cpuSampler struct {
	quit chan struct{}
	done chan struct{}
	peak float64
	sum  float64
	n    int
}

func newCPUSampler(pid int, period time.Duration) *cpuSampler {
	s := &cpuSampler{quit: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		tick := time.NewTicker(period)
		defer tick.Stop()
		last, at := cpuSeconds(pid), time.Now()
		for {
			select {
			case <-s.quit:
				return
			case <-tick.C:
			}
			now, t := cpuSeconds(pid), time.Now()
			if t.Sub(at) < period/2 {
				continue // a late tick followed by a prompt one: too short to divide by
			}
			pct := 100 * (now - last) / t.Sub(at).Seconds()
			s.peak, s.sum, s.n = max(s.peak, pct), s.sum+pct, s.n+1
			last, at = now, t
		}
	}()
	return s
}

func (s *cpuSampler) stop() (peak, mean float64) {
	close(s.quit)
	<-s.done
	return s.peak, s.sum / float64(max(1, s.n))
}
