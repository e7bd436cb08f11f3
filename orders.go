package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"github.com/sirupsen/logrus"
)

// ordersConfig is the orders demo's setting.
type ordersConfig struct{ ReportCron string }

func (c *ordersConfig) settings() []configSetting {
	return []configSetting{
		{key: "jobs.reportCron", env: "KUMIKO_REPORT_CRON", def: "*/5 * * * *", value: textValue{p: &c.ReportCron},
			doc: "the orders demo's periodic report: 5 cron fields, 6 with seconds, or @every 10s"},
	}
}

const (
	eventOrderCreated = "order.created"

	maxOrderBody      = 64 << 10 // bytes; 100 items fit many times over
	maxItems          = 100
	maxQty            = 1_000_000
	maxPriceCents     = 100_000_000
	maxIdempotencyKey = 255
)

// ordersFeature is the demo's business capability: orders taken over the
// API, each announcing itself as order.created through the outbox, which
// indexes it in Meilisearch and writes its sealed receipt to S3; a report
// counts them on a cron. Without it (orders*.go and its line in
// registerFeatures deleted) the service is the lifecycle alone.
func ordersFeature(cfg config) feature {
	created := prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: metricNamespace, Name: "orders_total", Help: "POST /api/orders outcomes: created, replayed, conflict.",
	}, []string{"result"})
	for _, r := range []string{"created", "replayed", "conflict"} {
		created.WithLabelValues(r) // at 0 from the start, for increase(...)
	}
	f := feature{
		name:      "orders",
		uses:      []dependency{usesDB, usesRedis, usesSearch, usesStorage, usesMasterKey},
		publishes: []string{eventOrderCreated},
		workers:   []worker{work(indexOrder), work(writeReceipt), work(writeReport)},
		crons: []cronJob{schedule(cfg.Orders.ReportCron, func(tick time.Time, token int64) reportArgs {
			return reportArgs{CronRun{ScheduledAt: tick, FencingToken: token}}
		})},
		manualJobs: []manualJob{byHand(func(echo.Context) (reportArgs, error) {
			return reportArgs{CronRun{ScheduledAt: time.Now().UTC(), Manual: true}}, nil
		})},
		searchIndexes: []searchIndex{{uid: ordersIndex, primaryKey: "id", searchable: []string{"customer", "items.sku"}}},
		collectors:    []prometheus.Collector{created},
		routes: []route{
			{method: http.MethodPost, path: "/api/orders", handler: func(d routeDeps) echo.HandlerFunc {
				return handleCreateOrder(d.db, newOrderWriter(d.db, d.timeouts), d.redis, d.masterKey, d.timeouts, created, d.log.WithField("component", "orders"))
			}},
			// An order is read with the token its POST answered (orders_access.go).
			{method: http.MethodGet, path: "/api/orders/:id", handler: func(d routeDeps) echo.HandlerFunc {
				return handleGetOrder(d.db, d.masterKey, d.timeouts)
			}},
			// Names and items are personal data: listed, searched and read by
			// anyone's id on the ops port only.
			{method: http.MethodGet, path: "/admin/orders", admin: true, handler: func(d routeDeps) echo.HandlerFunc {
				return handleSearchOrders(d.db, d.search, d.timeouts, d.log.WithField("component", "orders"))
			}},
			{method: http.MethodGet, path: "/admin/orders/:id", admin: true, handler: func(d routeDeps) echo.HandlerFunc {
				return handleAdminGetOrder(d.db, d.timeouts)
			}},
		},
	}
	// An order triggers only the jobs whose dependency is configured (a
	// configured one that is down is skipped at phase 11/12 and retried by River).
	if cfg.Search.URL != "" {
		f.subscriptions = append(f.subscriptions, subscribe(eventOrderCreated, func(evs []outboxEvent) (indexOrderArgs, error) {
			ids, err := orderIDsOf(evs)
			return indexOrderArgs{OrderIDs: ids}, err
		}))
	}
	if cfg.Storage.Endpoint != "" {
		f.subscriptions = append(f.subscriptions, subscribe(eventOrderCreated, func(evs []outboxEvent) (writeReceiptArgs, error) {
			ids, err := orderIDsOf(evs)
			return writeReceiptArgs{OrderIDs: ids}, err
		}))
	}
	return f
}

// orderIDsOf are the orders order events are about: their aggregate ids.
func orderIDsOf(evs []outboxEvent) ([]int64, error) {
	ids := make([]int64, len(evs))
	for i, ev := range evs {
		id, err := strconv.ParseInt(ev.AggregateID, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("event %d: aggregate id %q is not an order id", ev.ID, ev.AggregateID)
		}
		ids[i] = id
	}
	return ids, nil
}

// order is an order as stored and as answered. Clients only ever see the
// opaque PublicID (as "id"); the sequential ID stays inside, for joins, jobs
// and the outbox. It never holds the read token: orders are also indexed
// and sealed into receipts, and the token is only ever answered to the
// order's creator (writeOrder).
type order struct {
	ID         int64       `json:"-"`
	PublicID   uuid.UUID   `json:"id"`
	Customer   string      `json:"customer"`
	Items      []orderItem `json:"items"`
	TotalCents int64       `json:"totalCents"`
	CreatedAt  time.Time   `json:"createdAt"`
}

type orderItem struct {
	SKU        string `json:"sku"`
	Qty        int64  `json:"qty"`
	PriceCents int64  `json:"priceCents"`
}

// newOrder is the body of POST /api/orders.
type newOrder struct {
	Customer string      `json:"customer"`
	Items    []orderItem `json:"items"`
}

// validate lists every problem of the body at once.
func (o newOrder) validate() []string {
	var problems []string
	if n := utf8.RuneCountInString(strings.TrimSpace(o.Customer)); n < 1 || n > 200 {
		problems = append(problems, "customer: must be 1 to 200 characters")
	} else if !visible(o.Customer) {
		problems = append(problems, "customer: must show at least one visible character")
	}
	if problem := textProblem(o.Customer); problem != "" {
		problems = append(problems, "customer: "+problem)
	}
	if len(o.Items) < 1 || len(o.Items) > maxItems {
		problems = append(problems, fmt.Sprintf("items: must hold 1 to %d items", maxItems))
	}
	for i, it := range o.Items {
		if n := utf8.RuneCountInString(it.SKU); n < 1 || n > 64 {
			problems = append(problems, fmt.Sprintf("items[%d].sku: must be 1 to 64 characters", i))
		} else if !visible(it.SKU) {
			problems = append(problems, fmt.Sprintf("items[%d].sku: must show at least one visible character", i))
		}
		if problem := textProblem(it.SKU); problem != "" {
			problems = append(problems, fmt.Sprintf("items[%d].sku: %s", i, problem))
		}
		if it.Qty < 1 || it.Qty > maxQty {
			problems = append(problems, fmt.Sprintf("items[%d].qty: must be from 1 to %d", i, maxQty))
		}
		if it.PriceCents < 0 || it.PriceCents > maxPriceCents {
			problems = append(problems, fmt.Sprintf("items[%d].priceCents: must be from 0 to %d", i, maxPriceCents))
		}
	}
	return problems
}

func (o newOrder) total() int64 {
	var total int64
	for _, it := range o.Items {
		total += it.Qty * it.PriceCents // bounded by validate: at most 10^16
	}
	return total
}

// fingerprint identifies the request behind an Idempotency-Key, so the same
// key sent with a different body is refused rather than answered with the
// first order.
func (o newOrder) fingerprint() string {
	canonical, _ := json.Marshal(o) // a struct of strings and ints always encodes
	sum := sha256.Sum256(canonical)
	return hex.EncodeToString(sum[:])
}

// decodeOrder reads a JSON body strictly: the media type, the size limit,
// the read deadline, valid UTF-8 (encoding/json would silently turn invalid
// bytes into U+FFFD and store an altered order), duplicate and case-variant
// keys (keyProblem), unknown fields, trailing data and every field's rules.
func decodeOrder(c echo.Context) (newOrder, error) {
	var o newOrder
	if mt, _, err := mime.ParseMediaType(c.Request().Header.Get(echo.HeaderContentType)); err != nil || mt != echo.MIMEApplicationJSON {
		return o, apiError(http.StatusUnsupportedMediaType, "unsupported_media_type", "send the order as application/json")
	}
	// A declared length over the limit is refused before the body is read:
	// reading is what makes net/http answer "100 Continue", inviting a body
	// that would only be thrown away. A chunked body is cut at the limit.
	if c.Request().ContentLength > maxOrderBody {
		return o, errBodyTooLarge
	}
	raw, err := io.ReadAll(http.MaxBytesReader(c.Response(), c.Request().Body, maxOrderBody))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return o, errBodyTooLarge
	case errors.Is(err, os.ErrDeadlineExceeded):
		return o, apiError(http.StatusRequestTimeout, "request_timeout", "the body did not arrive in time")
	case err != nil:
		return o, apiError(http.StatusBadRequest, "invalid_body", "the body could not be read")
	case !utf8.Valid(raw):
		return o, apiError(http.StatusBadRequest, "invalid_json", "the body is not valid UTF-8")
	}
	if problem := keyProblem(raw, orderFieldNames); problem != "" {
		return o, apiError(http.StatusBadRequest, "invalid_json", problem)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	err = dec.Decode(&o)
	if err == nil && dec.More() {
		return o, apiError(http.StatusBadRequest, "invalid_json", "unexpected data after the JSON object")
	}
	if err != nil {
		return o, apiError(http.StatusBadRequest, "invalid_json", jsonProblem(err))
	}
	if problems := o.validate(); len(problems) > 0 {
		return o, apiError(http.StatusUnprocessableEntity, "validation_failed", strings.Join(problems, "; "))
	}
	o.Customer = strings.TrimSpace(o.Customer)
	return o, nil
}

// handleCreateOrder is POST /api/orders. The order row and its order.created
// event are written in one statement, which the orders of concurrent
// requests share (orderWriter). With an Idempotency-Key, the unique
// column is the truth (it survives a crash that loses the Redis marker); the
// marker, a lease held while the request runs, turns a concurrent duplicate
// into a 409 with Retry-After (or a 422 for another body) instead of a race. Every
// dependency call shares the request's budget (t.request): a hung database
// is a 503 within it, and a Redis that does not answer within t.marker gives
// way to the unique column. The answer carries the order's read token
// (orders_access.go), the same on every replay.
func handleCreateOrder(db *pgxpool.Pool, w *orderWriter, rdb *redis.Client, key *masterKey, t timeouts, created *prometheus.CounterVec, log *logrus.Entry) echo.HandlerFunc {
	createdNew := created.WithLabelValues("created") // the hot one, looked up once
	answer := func(c echo.Context, o order) error { return writeOrder(c, o, readToken(key, o.PublicID)) }
	replay := func(c echo.Context, o order) error {
		created.WithLabelValues("replayed").Inc()
		c.Response().Header().Set("Idempotent-Replayed", "true")
		return answer(c, o)
	}
	// failed answers err. An order whose statement was interrupted and could
	// not be settled may be stored: the client is told where to look it up,
	// not to send it again.
	failed := func(c echo.Context, id uuid.UUID, err error) error {
		if !errors.Is(err, errOutcomeUnknown) {
			return err
		}
		created.WithLabelValues("unknown").Inc()
		log.WithError(err).Warn("order outcome unknown: answered 504 with its id")
		return writeOutcomeUnknown(c, id, readToken(key, id))
	}
	return func(c echo.Context) error {
		req, err := decodeOrder(c)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(c.Request().Context(), t.request)
		defer cancel()
		// The order's id is drawn once: a retry inserts the same id, so the
		// unique index tells whether the first try committed after all (a
		// server going away may say so only after the commit).
		publicID, err := uuid.NewV7() // time-ordered, so the unique index stays compact
		if err != nil {
			return fmt.Errorf("generating the order id: %w", err)
		}
		create := func(key, hash string) (order, error) {
			return retrySafe(ctx, db, func(ctx context.Context) (order, error) {
				o, err := w.create(ctx, publicID, req, key, hash)
				if errors.Is(err, errOrderConflict) {
					return orderByPublicID(ctx, db, publicID) // ErrNoRows: another request's key
				}
				return o, err
			})
		}
		key := c.Request().Header.Get("Idempotency-Key")
		if key == "" {
			o, err := create("", "")
			if err != nil {
				return failed(c, publicID, err)
			}
			createdNew.Inc()
			return answer(c, o)
		}
		if len(key) > maxIdempotencyKey || !printableASCII(key) {
			return apiError(http.StatusBadRequest, "invalid_idempotency_key", fmt.Sprintf("Idempotency-Key must be 1 to %d printable ASCII characters", maxIdempotencyKey))
		}
		hash := req.fingerprint()
		byKey := func() (order, error) {
			return retrySafe(ctx, db, func(ctx context.Context) (order, error) { return orderByKey(ctx, db, key, hash) })
		}

		// Done before? Answer exactly as the first time.
		if o, err := byKey(); err == nil {
			return replay(c, o)
		} else if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}

		// In flight right now? The marker is a lease its request renews while
		// it runs (orders_idempotency.go), so a holder that died frees the key
		// within idempotencyLease.
		lease, holderHash, err := claimMarker(ctx, rdb, idempotencyKeyPrefix+key, hash, t.marker)
		switch {
		case err != nil:
			// Without Redis the unique column still prevents a second order;
			// a concurrent duplicate is then answered with the first order.
			log.WithError(err).Warn("idempotency marker unavailable, relying on the unique key")
		case lease == nil:
			if o, err := byKey(); err == nil {
				return replay(c, o) // it finished in the meantime
			} else if !errors.Is(err, pgx.ErrNoRows) {
				return err // errKeyReused, or the database's trouble
			}
			if holderHash != hash {
				return errKeyReused
			}
			created.WithLabelValues("conflict").Inc()
			c.Response().Header().Set("Retry-After", "1")
			return apiError(http.StatusConflict, "request_in_progress", "a request with this Idempotency-Key is still in progress; retry later")
		default:
			defer func() {
				if err := lease.release(context.WithoutCancel(ctx)); err != nil {
					log.WithError(err).Debug("releasing the idempotency marker; its lease lapses by itself")
				}
			}()
		}

		o, err := create(key, hash)
		if errors.Is(err, pgx.ErrNoRows) {
			// The key's unique index refused this order: another request
			// with the same key won the race. Its order is this request's
			// answer, or errKeyReused when its body was another.
			o, err = byKey()
			if err == nil {
				return replay(c, o)
			}
		}
		if err != nil {
			return failed(c, publicID, err)
		}
		createdNew.Inc()
		return answer(c, o)
	}
}

// writeOutcomeUnknown answers 504 outcome_unknown for an order that may be
// stored: its id and read token, and where to look (Location). The client
// reads GET /api/orders/{id} once the database answers: 200 is its order,
// 404 means it was not stored and may be sent again. No Retry-After: a
// blind retry without an Idempotency-Key could store it twice.
func writeOutcomeUnknown(c echo.Context, id uuid.UUID, token string) error {
	c.Response().Header().Set(echo.HeaderLocation, "/api/orders/"+id.String())
	return c.JSON(http.StatusGatewayTimeout, outcomeUnknownBody{
		Error: errorBody{Code: "outcome_unknown", Message: "the database did not confirm whether the order was stored; " +
			"read it with GET /api/orders/{id} and its readToken before sending it again"},
		ID: id.String(), ReadToken: token})
}

// outcomeUnknownBody is the 504 answer: the usual error, and the order's
// capability to look it up.
type outcomeUnknownBody struct {
	Error     errorBody `json:"error"`
	ID        string    `json:"id"`
	ReadToken string    `json:"readToken"`
}

// createdOrder is the answer to POST /api/orders: the order, and the
// capability to read it again.
type createdOrder struct {
	order
	ReadToken string `json:"readToken"`
}

// writeOrder answers 201 with the created order o and its read token as
// c.JSON would, byte for byte, without reflection: encoding/json's
// reflection was 7 % of the service's CPU under load. A request with a
// query (echo indents for ?pretty) gets c.JSON itself. The token is the
// creator's alone: no cache may keep the answer.
func writeOrder(c echo.Context, o order, token string) error {
	c.Response().Header().Set(echo.HeaderCacheControl, "no-store")
	if c.Request().URL.RawQuery != "" || c.Echo().Debug {
		return c.JSON(http.StatusCreated, createdOrder{order: o, ReadToken: token})
	}
	return c.Blob(http.StatusCreated, echo.MIMEApplicationJSON, appendOrderJSON(make([]byte, 0, 320), o, token))
}

// appendOrderJSON appends createdOrder{o, token} as encoding/json's Encoder
// encodes it, newline included. token is URL-safe base64: nothing to escape.
func appendOrderJSON(b []byte, o order, token string) []byte {
	b = append(b, `{"id":"`...)
	b = append(b, o.PublicID.String()...)
	b = append(b, `","customer":`...)
	b = appendJSONString(b, o.Customer)
	b = append(b, `,"items":`...)
	if o.Items == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, it := range o.Items {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"sku":`...)
			b = appendJSONString(b, it.SKU)
			b = append(b, `,"qty":`...)
			b = strconv.AppendInt(b, it.Qty, 10)
			b = append(b, `,"priceCents":`...)
			b = strconv.AppendInt(b, it.PriceCents, 10)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	b = append(b, `,"totalCents":`...)
	b = strconv.AppendInt(b, o.TotalCents, 10)
	b = append(b, `,"createdAt":"`...)
	b = o.CreatedAt.AppendFormat(b, time.RFC3339Nano) // what time.Time.MarshalJSON writes
	b = append(b, `","readToken":"`...)
	b = append(b, token...)
	return append(b, "\"}\n"...)
}

// appendJSONString appends s quoted as encoding/json quotes it: printable
// ASCII other than the quote, the backslash and the HTML-escaped <, > and &
// as it is, anything else through encoding/json itself.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			quoted, _ := json.Marshal(s) // a string always encodes
			return append(b, quoted...)
		}
	}
	b = append(b, '"')
	b = append(b, s...)
	return append(b, '"')
}

// errBodyTooLarge answers an order body over maxOrderBody.
var errBodyTooLarge = apiError(http.StatusRequestEntityTooLarge, "payload_too_large", fmt.Sprintf("the body must be at most %d bytes", maxOrderBody))

// errKeyReused is answered when an Idempotency-Key comes back with another body.
var errKeyReused = apiError(http.StatusUnprocessableEntity, "idempotency_key_reused",
	"this Idempotency-Key was used for a different request")

// orderCreated is the order.created payload. GET /api/events shows payloads
// to anyone, so it tells that an order flowed and nothing about whose: no
// customer, no items, and no order id — the id is what a reader would use to
// find the order, and a name that travels links everything it is seen with.
// The jobs it starts need none of it: they load the order by the event's
// aggregate id, which stays inside (publicEvent). orderWriter writes it
// without CreatedAt, which the database adds (see insertOrdersAndEvents).
type orderCreated struct {
	Status     string    `json:"status"`
	TotalCents int64     `json:"totalCents"`
	ItemCount  int       `json:"itemCount"`
	CreatedAt  time.Time `json:"createdAt"`
}

// sqlJSONTime renders a UTC timestamp column as encoding/json renders the
// same instant as a UTC time.Time: microseconds, trailing zeros dropped.
func sqlJSONTime(col string) string {
	return `to_char(` + col + `, 'YYYY-MM-DD"T"HH24:MI:SS') || coalesce('.' || nullif(rtrim(to_char(` + col + `, 'US'), '0'), ''), '') || 'Z'`
}

// appendOrderCreated encodes orderCreated without its CreatedAt, by hand:
// a constant and two integers need no reflection.
func appendOrderCreated(b []byte, totalCents int64, itemCount int) []byte {
	b = append(b, `{"status":"created","totalCents":`...)
	b = strconv.AppendInt(b, totalCents, 10)
	b = append(b, `,"itemCount":`...)
	b = strconv.AppendInt(b, int64(itemCount), 10)
	return append(b, '}')
}

// orderByPublicID loads an order by its public id.
func orderByPublicID(ctx context.Context, db *pgxpool.Pool, id uuid.UUID) (order, error) {
	return scanOrder(db.QueryRow(ctx, `SELECT `+orderColumns+` FROM orders WHERE public_id = $1`, id))
}

// orderByKey finds the order an Idempotency-Key created; a different request
// fingerprint is errKeyReused.
func orderByKey(ctx context.Context, db *pgxpool.Pool, key, hash string) (order, error) {
	var storedHash string
	o, err := scanOrder(db.QueryRow(ctx, `SELECT `+orderColumns+`, coalesce(request_hash, '')
		FROM orders WHERE idempotency_key = $1`, key), &storedHash)
	if err != nil {
		return order{}, err
	}
	if storedHash != hash {
		return order{}, errKeyReused
	}
	return o, nil
}

// orderColumns are the columns scanOrder reads, in its order.
const orderColumns = "id, public_id, customer, items, total_cents, created_at"

func scanOrder(row pgx.Row, extra ...any) (order, error) {
	var o order
	var items []byte
	if err := row.Scan(append([]any{&o.ID, &o.PublicID, &o.Customer, &items, &o.TotalCents, &o.CreatedAt}, extra...)...); err != nil {
		return order{}, err
	}
	o.CreatedAt = o.CreatedAt.UTC()
	if err := json.Unmarshal(items, &o.Items); err != nil {
		return order{}, fmt.Errorf("decoding the items of order %d: %w", o.ID, err)
	}
	return o, nil
}

func collectOrders(rows pgx.Rows, err error) ([]order, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	orders := []order{}
	for rows.Next() {
		o, err := scanOrder(rows)
		if err != nil {
			return nil, err
		}
		orders = append(orders, o)
	}
	return orders, rows.Err()
}

// orderFieldNames are the JSON keys of an order body, exactly as spelled.
var orderFieldNames = []string{"customer", "items", "sku", "qty", "priceCents"}
