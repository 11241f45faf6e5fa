"""The HTTP surface, the only package that speaks HTTP: `app` wires Falcon, the routes and the one mapping of
errors to the contract; the data API `/q` (`data`, its call options in `options`), the Management API
(`manage`, `roles`), the run history and `/events` (`runs`, its subscribers served off the request threads by
`eventhub`), the operations routes (`ops`), the caller's catalog (`catalog`),
OpenAPI and /docs (`openapi`) and the operators' Console (`console`); what the routes share is `common`. Nothing
outside this package imports from it but the process side (`qag.server`), which serves it, and the demo."""
